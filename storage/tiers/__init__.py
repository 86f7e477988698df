"""Tiers beyond the device and host: the disk tier on lmdb (its files, spilled live pages and their
runs), the remote tier on a Redis-protocol server (with a local server for tests), their keys and
how a user's arguments open them."""
