"""Secrets that never enter the guest: the model, the encrypted vault, the
per-sandbox CA. The substitution proxy is actors/secrets/secretproxy.py; docs/secrets.md."""
