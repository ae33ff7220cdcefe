"""OpenAI's Images and Videos API over the one-shot jobs (issue 26; docs/openai.md).

A thin adapter: ``POST /v1/images/generations`` and ``POST /v1/videos`` become jobs of
``sessions.jobs`` (the same validation, per-user limit, dispatcher, preemption and audit as
``/api/jobs/``), their answers are OpenAI's objects, and every error is OpenAI's shape
(``errors``). The official ``openai`` SDK is the client the tests drive it with.
"""
