"""Shared support of every wing: errors, argument checks, fork handling."""
