import sys

from kvelastic.sim.run import main

sys.exit(main(sys.argv[1:]))
