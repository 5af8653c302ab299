"""Each notebook's experiments, one module per notebook (``lab05``, ``lab06``, ...).

A lab function runs the course's mechanism (the strategies, ``loop.run_steps`` with observers,
``launch``) and returns plain data for the notebook to show and assert. Labs sit above
everything else in the package: nothing in ``course_utils`` imports them.
"""
