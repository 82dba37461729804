"""Shared support of both wings: errors, argument checks, fork handling."""
