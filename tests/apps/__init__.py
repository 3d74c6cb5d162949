"""Small Celery apps started by test workers (``celery -A apps.<name>``)."""
