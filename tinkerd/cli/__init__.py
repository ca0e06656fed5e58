"""The `tinkerd` command line."""

# One format for the server's log lines and its engine process's (which configures its own logging).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
