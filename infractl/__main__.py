"""``python -m infractl``: the same CLI as the ``infractl`` console script."""

from infractl.cli import main

main()
