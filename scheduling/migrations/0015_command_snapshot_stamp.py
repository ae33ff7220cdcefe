"""Worker commands stamped on insert like sessions (``streams`` 0010; a sequence of their own): the pool cache reads the newest
start/resume/activate of each session only from commands inserted since its last read (issue 30)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0014_worker_command_undrain"),
    ]

    operations = [
        migrations.AddField(
            model_name="workercommand",
            name="snapshot_seq",
            field=models.BigIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="workercommand",
            name="snapshot_xid",
            field=models.BigIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddIndex(
            model_name="workercommand",
            index=models.Index(fields=["snapshot_seq"], name="command_snapshot_seq"),
        ),
        migrations.AddIndex(
            model_name="workercommand",
            index=models.Index(fields=["snapshot_xid"], name="command_snapshot_xid"),
        ),
        migrations.RunSQL(
            sql=[
                "CREATE SEQUENCE scheduling_command_snapshot_seq",
                """
                CREATE FUNCTION scheduling_command_snapshot_stamp() RETURNS trigger AS $$
                BEGIN
                    IF TG_OP = 'INSERT' THEN
                        NEW.snapshot_seq := nextval('scheduling_command_snapshot_seq');
                        NEW.snapshot_xid := pg_current_xact_id()::text::bigint;
                    ELSE
                        NEW.snapshot_seq := OLD.snapshot_seq;
                        NEW.snapshot_xid := OLD.snapshot_xid;
                    END IF;
                    RETURN NEW;
                END
                $$ LANGUAGE plpgsql
                """,
                """
                CREATE TRIGGER command_snapshot_stamp BEFORE INSERT OR UPDATE ON scheduling_workercommand
                FOR EACH ROW EXECUTE FUNCTION scheduling_command_snapshot_stamp()
                """,
            ],
            reverse_sql=[
                "DROP TRIGGER IF EXISTS command_snapshot_stamp ON scheduling_workercommand",
                "DROP FUNCTION IF EXISTS scheduling_command_snapshot_stamp()",
                "DROP SEQUENCE IF EXISTS scheduling_command_snapshot_seq",
            ],
        ),
    ]
