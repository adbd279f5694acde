"""Tools that write files of the repository from the code (`make reference`)."""
