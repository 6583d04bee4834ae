"""Rendezvous: how ranks find each other (key-value stores and their URLs)."""
