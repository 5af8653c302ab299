"""Reference solutions of the course's exercises, one module per notebook (loaded by ``load_solution``)."""
