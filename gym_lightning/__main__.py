"""``python -m gym_lightning``: see ``gym_lightning.cli``."""

from gym_lightning.cli import main

if __name__ == "__main__":
    main()
