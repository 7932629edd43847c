"""Transports: a ZMQ pair carries the control messages and headers; a payload plane the tensor bytes.

ZMQ pair: ROUTER (decode receiver, binds; ``zmq_receiver``) / DEALER (prefill sender, connects;
``zmq_sender``). Every ZMQ message on it starts with a one-byte tag frame (``interfaces.TAG_*``):

    sender -> receiver   [C, hello | bye]                control (msgpack)
                         [M, header, tensor_1 .. tensor_n] a state message (frames as wire builds them;
                                                         the dist kind sends [M, header] only)
    receiver -> sender   [C, welcome | refuse | transport.reject | ping]
                         [R, reply]                      StateReceiver.reply (msgpack)

Payload planes (``plane``): the zmq-tcp / zmq-ipc kinds send tensor frames in the state message
itself, with ``copy=False`` (zero-copy for frames over pyzmq's copy threshold), received as
zmq.Frame buffers (memoryviews), never copied by the transport. The dist kind (``dist``) sends
them over a torch.distributed pair group.

Security: with a cluster ``secret`` (both sides, ``kvtransfer.secure``) the pair runs CURVE
(ZMQ RFC 26, encryption + mutual authentication; the receiver's ZAP handler, RFC 27, accepts only
the cluster's client key): a peer without the secret never gets a frame to the receiver, and a
sender whose secret differs fails ``connect`` with TransportError (fast, from the socket's
handshake-failure events; at worst at ``timeout_s``). Without a secret, plain ZMQ: bind to
loopback or a trusted network. Either way every socket bounds one frame (``MAXMSGSIZE``), the
receiver never raises on garbage, drops what it cannot parse (counted in ``stats``, a warning
at most once per cause per 10 s) and keeps at most ``max_peers`` peers, pruning disconnected ones
when full.
"""
