import sys

from kvelastic_tools.sim.run import main

sys.exit(main(sys.argv[1:]))
