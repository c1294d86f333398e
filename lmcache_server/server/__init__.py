"""The server: ZeroMQ front end, request handlers, admission control, HTTP endpoint."""
