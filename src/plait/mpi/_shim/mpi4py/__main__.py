"""``python -m mpi4py [options] <pyfile | -m mod | -c cmd | -> [arg] ...``: :mod:`mpi4py.run`."""

from .run import main

if __name__ == "__main__":
    main()
