"""The server: ZeroMQ front end (zmq_server, dispatch, replies), request handlers, in-flight
limits (inflight), the same-host shared-memory path (shm/), HTTP endpoint."""
