"""``python -m examples.gridding``: the imaging demo (see demo.py)."""

from examples.gridding.demo import main

main()
