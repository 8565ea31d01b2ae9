"""``python -m st_cached_losses.demo``: the demo's command line (see [`st_cached_losses.demo.app`][st_cached_losses.demo.app])."""

from st_cached_losses.demo.app import main

if __name__ == "__main__":
    main()
