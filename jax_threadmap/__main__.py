"""``python -m jax_threadmap``: the demo."""

from ._demo.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
