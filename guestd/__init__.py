"""guestd: the in-guest agent of sandvisor (stdlib + msgpack only)."""
