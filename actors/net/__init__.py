"""Host networking: tap links, the IP pool, the nftables rules of the egress policy, the
DNS proxy, port relays, the secret proxy's cell."""
