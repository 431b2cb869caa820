"""Integrations with serving engines; each talks to its engine only through the public transfer API."""
