"""State transports (zmq-tcp, zmq-ipc, dist over gloo) on real sockets: exact bytes, order, the
handshake refuses mismatches by name, garbage never kills a receiver, replies, many senders, close."""
