"""``python -m tensortape``: the command line."""
from tensortape.cli import main

if __name__ == "__main__":
    main()
