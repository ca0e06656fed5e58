"""The schema revisions, oldest first: one file each (docs/architecture.md §4, Schema changes)."""
