from .job import _main

_main()
