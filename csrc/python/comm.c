/* comm.c - the CommOverlap type (to be written). */
#include "module.h"

int tec_comm_exec(PyObject *module) { (void)module; return 0; }
int tec_comm_traverse(tec_module_state *st, visitproc visit, void *arg) { (void)st; (void)visit; (void)arg; return 0; }
void tec_comm_clear(tec_module_state *st) { (void)st; }
