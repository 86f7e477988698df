"""Checked records: spilled pages and prefix blocks as they are written to the disk and remote tiers
and handed over, their parts, checksums and entropy coding."""
