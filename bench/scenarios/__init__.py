"""One module per benchmark: a docstring (its help), add_arguments(parser), run(args) -> dict."""
