"""Names the server tests share (importable without FastAPI, unlike ``testing``)."""

MODEL_NAME = "tiny-llama"  # what the test servers serve the tiny model as
MAX_BODY_BYTES = 64 * 1024  # the shared test server's body limit
COMPLETIONS = "/v1/completions"  # the two OpenAI routes the tests post to
CHAT = "/v1/chat/completions"
