"""The host end of the guest channel: guestd's protocol, its streams and the bounds on what a guest sends."""
