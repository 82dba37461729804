"""The maps wing's public API and primitive: ``threadmap``, ``kernel``, ``threadmap_p``
and its rules, their params."""
