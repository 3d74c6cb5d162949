"""The kombu transport ``envelope://``: transport, channel, inbox, settling and bindings.

It turns kombu's calls into store operations and stream entries into kombu messages;
message adapters (``celery_ext`` adds Celery's) map messages to Envelopes.
"""
