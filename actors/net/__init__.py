"""Host networking: tap links, the IP pool, egress policy (nftables), the DNS proxy, port relays."""
