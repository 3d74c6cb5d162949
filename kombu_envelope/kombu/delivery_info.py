"""The delivery_info keys that tie a delivered kombu message to its stream entry."""

#: The stream and id of the entry a message was read from.
INFO_STREAM = "envelope_stream"
INFO_ENTRY_ID = "envelope_entry_id"
#: The consumer that read the entry, and the entry's queue.
INFO_CONSUMER = "envelope_consumer"
INFO_QUEUE = "envelope_queue"
#: Set by a consumer before reject() to name the failure class, and why.
INFO_FAILURE_CLASS = "envelope_failure_class"
INFO_FAILURE_REASON = "envelope_failure_reason"
#: The task_id and task_type of the entry's Envelope (absent for non-task messages).
INFO_TASK_ID = "envelope_task_id"
INFO_TASK_TYPE = "envelope_task_type"
#: Set on a task delivered only to be recorded as not run: "cancelled" or "expired"
#: (the ``reason`` its task record gets when it is acknowledged).
INFO_SKIPPED = "envelope_skipped"
#: When the entry's task was due, ms since the Unix epoch: its Envelope's ``schedule_time``
#: when set, else its ``created_at`` (an attempt's wait to start counts from it).
INFO_DUE_MS = "envelope_due_ms"
#: The running key of the concurrency slot the entry holds, on a queue with limits
#: (docs/protocol.md, section 19); the slot's member is the delivery tag.
INFO_SLOT = "envelope_slot"
#: The ordering key of the entry's task (docs/protocol.md, section 20), when it has one.
INFO_ORDER = "envelope_order"
