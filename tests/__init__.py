"""The test suite, laid out as api/ is: a folder per layer (http, serving, models, batch,
observability) and, at this level, the tests of api's own modules (settings, metrics, cpus);
then the whole service (service), what ships around it (deploy, bench, scripts, project), and
tests/support, the helpers the tests share."""
