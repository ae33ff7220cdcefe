"""The scheduler's pool cache reads only the session rows changed since its last read (issue 30).

A trigger stamps each row, on insert and whenever a column the scheduler's snapshot reads changes
(not on the chunk counters, which change every chunk), with the next value of
``streams_session_snapshot_seq`` and the writing (top-level) transaction's id. ``scheduling.live.snapshot``
says why both are needed: the sequence orders the writes, the transaction id catches a write that
took its number before a read and committed after it.
"""

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0009_default_tenant"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RunSQL(
            sql=[
                "CREATE SEQUENCE streams_session_snapshot_seq",
                """
                CREATE FUNCTION streams_session_snapshot_stamp() RETURNS trigger AS $$
                BEGIN
                    IF TG_OP = 'INSERT' OR (
                        OLD.model_name, OLD.status, OLD.activity, OLD.load, OLD.worker_id,
                        OLD.host_worker_id, OLD.region_id, OLD.tenant_id, OLD.origin,
                        OLD.last_active_at, OLD.created_at, OLD.state_location, OLD.queue_position
                    ) IS DISTINCT FROM (
                        NEW.model_name, NEW.status, NEW.activity, NEW.load, NEW.worker_id,
                        NEW.host_worker_id, NEW.region_id, NEW.tenant_id, NEW.origin,
                        NEW.last_active_at, NEW.created_at, NEW.state_location, NEW.queue_position
                    ) THEN
                        NEW.snapshot_seq := nextval('streams_session_snapshot_seq');
                        NEW.snapshot_xid := pg_current_xact_id()::text::bigint;
                    ELSE
                        NEW.snapshot_seq := OLD.snapshot_seq;
                        NEW.snapshot_xid := OLD.snapshot_xid;
                    END IF;
                    RETURN NEW;
                END
                $$ LANGUAGE plpgsql
                """,
            ],
            reverse_sql=[
                "DROP FUNCTION IF EXISTS streams_session_snapshot_stamp() CASCADE",
                "DROP SEQUENCE IF EXISTS streams_session_snapshot_seq",
            ],
        ),
        migrations.AddField(
            model_name="generationsession",
            name="snapshot_seq",
            field=models.BigIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="generationsession",
            name="snapshot_xid",
            field=models.BigIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddIndex(
            model_name="generationsession",
            index=models.Index(fields=["model_name", "snapshot_seq"], name="session_snapshot_seq"),
        ),
        migrations.AddIndex(
            model_name="generationsession",
            index=models.Index(fields=["snapshot_xid"], name="session_snapshot_xid"),
        ),
        migrations.AddIndex(
            model_name="generationsession",
            index=models.Index(
                condition=models.Q(("status", "terminated"), _negated=True),
                fields=["model_name"],
                name="session_live_by_model",
            ),
        ),
        migrations.RunSQL(
            sql="""
            CREATE TRIGGER session_snapshot_stamp BEFORE INSERT OR UPDATE ON streams_generationsession
            FOR EACH ROW EXECUTE FUNCTION streams_session_snapshot_stamp()
            """,
            reverse_sql="DROP TRIGGER IF EXISTS session_snapshot_stamp ON streams_generationsession",
        ),
    ]
