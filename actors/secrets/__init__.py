"""Secrets that never enter the guest: the model, the encrypted vault, the
per-sandbox CA. The substitution proxy is actors/net/secretproxy.py; docs/secrets.md."""
