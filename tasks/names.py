"""Task names (Celery `task` header) and the operation each stands for."""

ENCODE = "shoal.encode"
SCORE = "shoal.score"
EXTRACT = "shoal.extract"
CLASSIFY = "shoal.classify"
GENERATE = "shoal.generate"

OPERATION_OF_TASK = {
    ENCODE: "encode", SCORE: "score", EXTRACT: "extract", CLASSIFY: "classify",
    GENERATE: "generate",
}
TASK_OF_OPERATION = {op: name for name, op in OPERATION_OF_TASK.items()}
