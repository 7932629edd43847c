"""Transports: a ZMQ pair carries the control messages and headers; tensor bytes travel in the
same ZMQ messages (zmq-tcp, zmq-ipc) or over a torch.distributed pair group (dist)."""
