"""Transport security and request hygiene shared by router and node: TLS credentials
(``tls``), the development certificate authority (``certs``), and the server-side guard that
turns unparseable requests into INVALID_ARGUMENT (``guard``)."""
