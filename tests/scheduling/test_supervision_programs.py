"""The platform's command lines, written once (``scheduling.supervision``) for supervisord, the
benchmarks' platform and the end-to-end tests' platform."""

from __future__ import annotations

from pathlib import Path

import yaml
from django.conf import settings
from supervisor.options import ServerOptions

from scheduling.supervision import (
    beat_argv,
    media_argv,
    platform_programs,
    scheduler_argv,
    supervisord_config,
    web_argv,
)


def test_the_supervised_programs_are_the_shared_command_lines():
    programs = {p.name: p for p in platform_programs(host="0.0.0.0", port=8100, python="py")}
    assert programs["web"].argv == web_argv(host="0.0.0.0", port=8100, python="py")
    assert programs["web"].argv[-9:] == (
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--ws",
        "websockets-sansio",
        "--lifespan",
        "off",
        "--no-access-log",
    )
    assert programs["scheduler"].argv == scheduler_argv(python="py")
    assert programs["scheduler"].stopwaitsecs == 70  # a Celery worker finishes its tasks
    assert programs["beat"].argv == beat_argv(python="py")
    # WebRTC's peer connections in their own process (WEBRTC_MEDIA=process, the default)
    assert programs["media"].argv == media_argv(python="py") == ("py", "manage.py", "runmedia")


def test_inline_webrtc_runs_no_media_process(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WEBRTC_MEDIA": "inline"}
    assert "media" not in {p.name for p in platform_programs(host="127.0.0.1", port=8100, python="py")}


def test_a_node_name_and_a_beat_schedule_file_are_options():
    assert scheduler_argv(node_name="bench-1@%h", python="py")[-3:] == ("bench-1@%h", "--loglevel", "INFO")
    assert beat_argv(schedule=Path("/tmp/beat"), python="py")[-2:] == ("-s", "/tmp/beat")


def test_the_generated_config_escapes_celerys_percent(tmp_path):
    config = supervisord_config(platform_programs(host="127.0.0.1", port=8100, python="py"), run_dir=tmp_path)
    assert "-n scheduler@%%h" in config
    assert "[program:web]" in config and "[program:beat]" in config


def test_a_host_cache_is_supervised_only_when_models_are_named():
    assert "hostcache" not in {p.name for p in platform_programs(host="127.0.0.1", port=8100, python="py")}
    programs = {
        p.name: p
        for p in platform_programs(
            host="127.0.0.1", port=8100, python="py", hostcache_models=["demo", "tiny"]
        )
    }
    assert programs["hostcache"].argv == (
        "py",
        "manage.py",
        "hostcache",
        "--model",
        "demo",
        "--model",
        "tiny",
    )


def test_the_kubernetes_web_container_runs_the_same_server_command_line():
    manifest = next(
        doc
        for doc in yaml.safe_load_all((Path(settings.BASE_DIR) / "deploy" / "web.yaml").read_text())
        if doc["kind"] == "Deployment"
    )
    (web,) = manifest["spec"]["template"]["spec"]["containers"]
    assert tuple(web["command"]) == web_argv(host="0.0.0.0", port=8000, python="python")


def test_supervisord_writes_each_line_of_its_own_log_once(tmp_path):
    # given the generated config (its log file is /dev/stdout, and it runs in the foreground)
    config = tmp_path / "supervisord.conf"
    config.write_text(supervisord_config(platform_programs(host="127.0.0.1", port=8100), run_dir=tmp_path))
    options = ServerOptions()
    options.realize(args=["--configuration", str(config)])
    # when supervisord sets up its logger
    options.make_logger()
    try:
        # then one handler writes it: no foreground echo to stdout beside the /dev/stdout log file
        assert options.nodaemon
        (handler,) = options.logger.handlers
        assert handler.baseFilename == "/dev/stdout"
    finally:
        for handler in options.logger.handlers:
            if hasattr(handler, "baseFilename"):  # an echo handler's stream is this process's stdout
                handler.close()


def test_the_kubernetes_media_container_runs_the_same_command_line():
    manifest = yaml.safe_load((Path(settings.BASE_DIR) / "deploy" / "media.yaml").read_text())
    (media,) = manifest["spec"]["template"]["spec"]["containers"]
    assert tuple(media["command"]) == media_argv(python="python")
    kustomization = yaml.safe_load((Path(settings.BASE_DIR) / "deploy" / "kustomization.yaml").read_text())
    assert "media.yaml" in kustomization["resources"]
