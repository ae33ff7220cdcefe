"""The REST API's shared shape (Django REST framework)."""
