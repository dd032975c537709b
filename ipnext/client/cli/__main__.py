"""`python -m ipnext.client.cli`: the command line, as the `ipnext` script runs it."""

from ipnext.client.cli import main

main()
