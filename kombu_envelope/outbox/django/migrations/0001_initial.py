"""Creates the ``envelope_outbox`` table."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="OutboxEntry",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue", models.CharField(max_length=255)),
                ("task_id", models.CharField(max_length=255)),
                ("envelope", models.TextField()),
                ("created_at", models.DateTimeField()),
            ],
            options={"db_table": "envelope_outbox", "ordering": ["id"]},
        ),
    ]
