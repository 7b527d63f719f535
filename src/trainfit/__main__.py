"""``python -m trainfit``: the same entry point as the ``trainfit`` console script (``trainfit.cli.app.main``).

Useful where the script's directory is not on ``PATH`` (a venv that is not activated, ``pipx run``-less
environments, ``python -m`` inside notebooks' ``!`` shells).
"""

import sys

from trainfit.cli.app import main

if __name__ == "__main__":
    main(sys.argv[1:])
