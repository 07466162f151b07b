"""The router's own HTTP/1.1 client to the replicas: pooled connections and strict
response framing (`connection`), requests and responses (`client`)."""
