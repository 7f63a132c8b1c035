"""Training: the run loop shared by the verbs that train."""
