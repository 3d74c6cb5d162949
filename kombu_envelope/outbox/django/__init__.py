"""The outbox as a Django app: the ``envelope_outbox`` table, written inside ``transaction.atomic``.

Add ``"kombu_envelope.outbox.django"`` to ``INSTALLED_APPS`` and run ``migrate``;
then, inside an atomic block::

    with transaction.atomic():
        order.save()
        DjangoOutboxWriter().write("orders", Envelope.new(task_type="order.placed",
                                                          payload={"id": order.pk}))

Celery users set ``envelope_outbox = "django"`` instead (:mod:`celery_ext.outbox`).
The relay reads the same table through SQLAlchemy (``python -m kombu_envelope.outbox
--db ...``).
"""
