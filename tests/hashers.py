"""Password hashes for the suite's users: PBKDF2 at one round.

The suite creates hundreds of users (factories, fixtures); at Django's default ~1M rounds each costs
~0.23 s of CPU. A hash made here is an ordinary ``pbkdf2_sha256$1$…`` string: the round count is in
the hash, so the platform's own processes (started by e2e tests with the production hashers) verify
it as they would any other, and upgrade it on the user's first login.
"""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class OneRoundPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1
