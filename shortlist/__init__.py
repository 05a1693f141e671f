"""The `shortlist` console command (see shortlist.cli)."""
