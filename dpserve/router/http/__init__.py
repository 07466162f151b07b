"""The router's front: the ASGI app and its allow-list of routes (`app`), the HTTP
server and its limits on clients (`server`, `front`, `front_cycle`), who may call
what (`auth`) and the admin API (`admin`, `admin_body`). The top of the router: it
imports the rest, nothing below imports it."""
