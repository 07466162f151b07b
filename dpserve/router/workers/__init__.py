"""The data plane on more than one core: a leader process and follower workers.

`dpserve serve --workers N` (or `dpserve router --workers N`) runs the router in N
processes that accept on one port (SO_REUSEPORT: the kernel spreads connections).
The first process, the **leader**, is the router as with one worker: it alone
runs health checks, discovery, engine scrapes, deploys and the admin API, and it
serves requests too. Each **follower** runs only the data plane, on a mirror of
the leader's replica table, and sends everything else (probes, `/metrics`,
`/admin/*`, refusals) to the leader to answer.

Leader and follower talk over one socket pair (`wire`): the leader publishes the
table (states, versions, models, avoid marks, engine loads, the canary split, the
adapter table, and the requests in flight on each replica *elsewhere*); the
follower acknowledges each table and reports its own in-flight counts, canary
samples, replicas it found down, and its metrics. A drain waits until every
follower has acknowledged it and reports nothing in flight on the replica
(`Leader.settled`), so a deploy sees all of the fleet's traffic.

Routing memory (prefix homes, recent work) is shared (`work_table`). Kept per
worker, by design: circuit breakers (each sees its own failures), the admission
queue, and streams in flight (a drain's eviction is broadcast to every worker).
"""
